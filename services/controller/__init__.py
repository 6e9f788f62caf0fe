"""The controller role: staleness-bounded admission, server registry and routing, weight-sync
orchestration, durable state. Run it with `tandem controller --exp DIR` (see server.py)."""
