"""provision: lockfile-driven upgrades of GPU inference hosts (plan, apply into generations, probe, rollback)."""
__version__ = "0.1.0"
