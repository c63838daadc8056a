"""What every layer shares: the error classes (options), atomic user-file writes (files),
quiet imports and warnings (quiet), how the command was invoked (invocation), lazy exports (lazy), one writer at a
time on a folder (writer_lock)."""
