"""Runtime policy: the cost model, k and method choice, the batch policy and the exit layer,
measured on this machine and cached. Sits above the drafters, below the generator API."""
