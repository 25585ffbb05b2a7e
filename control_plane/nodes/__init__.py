"""Node health on the control plane: the record of each node's state and faults as the
agents report them (`record`), the operators' cordons (`actions`), what the API and the
CLI show (`views`) and the reliability each pool earns from its record (`reliability`)."""
