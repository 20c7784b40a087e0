"""The options provision's modules share, documented once (`extends_documentation_fragment: provision` for a module
that runs on the host, `provision.step` for one whose work runs in its action plugin); their argument specs come
from module_utils/provision/spec.py."""


class ModuleDocFragment:
    DOCUMENTATION = r"""
options:
  root:
    description: The host root (the inventory's provision_root).
    type: path
    default: /opt/provision
"""

    STEP = r"""
options:
  root:
    description: The host root (default the inventory's provision_root, else /opt/provision).
    type: path
  known_hosts:
    description: The known_hosts file host keys are checked against (default provision's, which
      `provision hosts trust` writes).
    type: path
  progress:
    description: A controller file to append the step's progress to, one JSON object a line (host, step, detail,
      seconds), at least every 2 s while it runs; `provision` tails it.
    type: path
"""
