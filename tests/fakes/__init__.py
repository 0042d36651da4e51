"""Test doubles for hardware this CI machine lacks: an NVML module and a powercap sysfs tree."""
