"""The arguments provision's modules share, declared once (documented once in doc_fragments/provision.py)."""

# A module that runs on the host: the host root.
ROOT = {"root": {"type": "path", "default": "/opt/provision"}}

# A module whose work runs in its action plugin (on the controller, over provision's host steps).
STEP = {"root": {"type": "path"},
        "known_hosts": {"type": "path"},
        "progress": {"type": "path"}}


def through_plugin(name, own):
    """main() of module `name` whose work runs in its action plugin (arguments `own` besides STEP): when run
    straight (e.g. `ansible -m`), its arguments are checked, then it fails saying where its work runs."""
    from ansible.module_utils.basic import AnsibleModule

    module = AnsibleModule(argument_spec=dict(STEP, **own), supports_check_mode=True)
    module.fail_json(msg="%s runs through its action plugin (action_plugins/%s.py beside this library): run it "
                         "from provision's playbooks directory" % (name, name))
