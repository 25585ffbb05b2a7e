"""Cost accounting: the replica ledger (`ledger`), the pure allocation of GPU dollars to
deployments, keys, teams and pools (`accounting`), its result (`model`) and the report
read from the database (`report`). The rules are in docs/cost.md."""
