"""A worker: one engine on its own thread in a role (prefill, decode, colocated) with the KV connector
of that role. No Ray: `cluster.ray_cluster` wraps it in an actor, tests drive it directly."""
