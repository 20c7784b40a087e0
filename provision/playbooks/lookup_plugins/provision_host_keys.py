"""provision_host_keys: the ssh options with which Ansible's own ssh checks a host's key as provision's steps check
it: strictly, against the managed known_hosts alone (`lookup('provision_host_keys', FILE)`; FILE '' for provision's
own, which `provision hosts trust` writes). One string, for ansible_ssh_common_args (tasks/host_keys.yml)."""
from __future__ import annotations

import importlib.util
import shlex
import sys
from pathlib import Path

from ansible.plugins.lookup import LookupBase

if importlib.util.find_spec("provision") is None:   # an ansible-playbook from another environment: the package
    sys.path.append(str(Path(__file__).resolve().parents[3]))   # these playbooks ship in, beside this directory

from provision.transport import DEFAULT_KNOWN_HOSTS, host_key_options  # noqa: E402

DOCUMENTATION = r"""
name: provision_host_keys
short_description: ssh options that check host keys against provision's known_hosts
description:
  - StrictHostKeyChecking=yes, UserKnownHostsFile the file given (a relative path from the working directory) or
    provision's own, and no global known_hosts; shell-quoted, as Ansible's ssh options are written.
options:
  _terms:
    description: The known_hosts file; empty for provision's (`provision hosts trust` writes it).
    required: false
"""


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):
        given = str(terms[0]) if terms and terms[0] else ""
        return [shlex.join(host_key_options(given or DEFAULT_KNOWN_HOSTS))]
