"""What scaletrain knows of the machine: measured peak rates and core contention (peak), the malloc the command
runs with (allocator), the catalog of devices and links the planner prices (catalog) and the reference CPU's
calibration (reference_cpu). The calibration itself is measured in plan/calibration.py, with the time model's own
operators."""
