"""Structured outputs: a request's `StructuredOutput` compiled into a grammar over the model's vocabulary
(`compiler`), and each request's position in it (`matcher`), with llguidance (docs/structured-outputs.md
says why that library). Light: no torch, so the front doors compile here to refuse a bad schema early;
the model runner turns the masks into tensors (`cluster.model.grammar_masks`)."""
