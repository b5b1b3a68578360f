"""Routing traces: the `Trace` type and its `.npz` file (`trace`), generators of synthetic load
(`generate`), importers of other tools' routing data (`importers`), statistics (`stats`) and the
fitting of a trace's source devices to a cluster's (`loads`)."""
