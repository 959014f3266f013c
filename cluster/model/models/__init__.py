"""One module per decoder family, each registered by its Hugging Face `architectures` name in
`cluster.model.registry`."""
