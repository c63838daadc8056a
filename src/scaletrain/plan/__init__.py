"""Know the cost before you train: hardware catalog, calibration, memory/time/cost models, plan search."""
