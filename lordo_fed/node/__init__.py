"""What runs on a node: the runtime (model, data, workers kept between rounds), the worker-state
store, and the long-lived node worker process with its local channel to the ClientApp."""
