"""Sub-FedAvg pruning (thesis Chapter 4): per-client masks, the prune decision and the masked
keeper mean, as a stage for every algorithm (``stage.Pruning``)."""
