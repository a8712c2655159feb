"""The τ² environment, whatever the domain: data, state, tool calls, user simulators, episodes, the protocol."""
