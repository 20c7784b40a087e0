"""The arguments provision's modules share, declared once (documented once in doc_fragments/provision.py)."""

# A module that runs on the host: the host root.
ROOT = {"root": {"type": "path", "default": "/opt/provision"}}

# A module whose work runs in its action plugin (on the controller, over provision's host steps).
STEP = {"root": {"type": "path"},
        "known_hosts": {"type": "path"},
        "progress": {"type": "path"}}
