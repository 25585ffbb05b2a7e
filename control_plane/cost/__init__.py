"""Cost accounting: the replica ledger (`ledger`), the pure allocation of GPU dollars to
deployments, keys, teams and pools (`accounting`), its result (`model`) and the report
read from the database (`report`); monthly team budgets: the policy (`budgets`), its passes
over the database (`budget_store`) and gauges (`budget_metrics`). The rules are in
docs/cost.md."""
