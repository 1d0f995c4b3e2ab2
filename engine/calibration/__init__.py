"""The machine: probe (hardware facts), measurements, memory estimates, decisions, the saved profile."""
