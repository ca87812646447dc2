"""Group `sessions`: agents as first-class citizens: upstream's session API and implicit
sessions drive L3 retention, "speaks next" hints and predicted return stage a context,
the session guard, tool-call turns and tool pins. The logic they install lives in
`sglang_l3.sessions`."""
