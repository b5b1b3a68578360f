"""The Balancer's decision, pure NumPy: one planning job (`job`) prices candidates (`pricing`)
and judges the plan in force (`evidence`, from the paired clock of `clock`); the `controller`
adopts, keeps or reverts."""
