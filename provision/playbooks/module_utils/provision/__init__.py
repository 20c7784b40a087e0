"""provision's host-side code as Ansible module_utils: `agent/` and `layout.py` are the very files the CLI's agents
run (links in a checkout, copies in the wheel); `step.py` runs one agent operation inside a module."""
