"""Operating a shared service: drift and quality monitoring of the served models."""

from tokenmill.ops.monitor import DriftMonitor
from tokenmill.ops.profile import Profile, load_profile
from tokenmill.ops.registry import MonitorRegistry

__all__ = ["DriftMonitor", "MonitorRegistry", "Profile", "load_profile"]
