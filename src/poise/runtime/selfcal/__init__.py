"""Self-calibration: the cost model's constants fitted to the run's measured phases (`fit`),
started from one start-up probe of the bulk-transfer rate (`probe`)."""
