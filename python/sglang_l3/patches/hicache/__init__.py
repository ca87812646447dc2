"""Group `hicache`: how pages move between device, host and L3 for a hybrid model in
buffer-only mode: re-anchor and its stale copy-on-write, branch-point backup, streamed
write and restore (sharing, damage re-fetch, the write guard, the wait watchdog), the
eager page hash."""
