"""Training: optimizer and parameter groups, LR schedule, precision, metrics, the trainer."""
