"""The cluster gateway: subscribes to every agent's snapshot stream and answers KEDA for the whole cluster."""
