"""pdserve: a serving cluster for LLMs, one subpackage per concern (docs/layout.md): `common` (the
shared vocabulary), `engine`, `model` and `weights` (the engine core: no Ray, HTTP or Redis),
`worker`, `transfer`, `state`, `ray_cluster` (the only code that imports ray), `serving` (the front
doors), `observability` and `bench`. `make lint` checks these layers."""

__version__ = "0.1.0"
