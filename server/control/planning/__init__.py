"""Planning and cost: capacity, GPU packing, right-sizing, prices, the cost ledger and its views, budgets."""
