"""The controller (policy versions, staleness-bounded admission, weight-sync orchestration)
and the wire protocol every role shares (`services.protocol`)."""
