"""The tau2 airline environment: data, state, tools, user simulators, episodes."""
