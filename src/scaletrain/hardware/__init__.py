"""What scaletrain knows of the machine: measured peak rates and core contention (peak),
the malloc the command runs with (allocator)."""
