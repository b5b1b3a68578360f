"""Planning off the critical path: the background worker (`background`, its process `worker`)
and the leader's decision shared with every rank (`broadcast`)."""
