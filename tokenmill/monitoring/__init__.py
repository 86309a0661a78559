"""Operating a shared service: drift and quality monitoring of the served models."""

from tokenmill.monitoring.monitor import DriftMonitor
from tokenmill.monitoring.profile import Profile, load_profile
from tokenmill.monitoring.registry import MonitorRegistry

__all__ = ["DriftMonitor", "MonitorRegistry", "Profile", "load_profile"]
