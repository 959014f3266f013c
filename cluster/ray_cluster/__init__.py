"""The Ray layer, the only code that imports ray: worker actors, the router, its routing policy, the
cluster launcher and the cluster configuration."""
