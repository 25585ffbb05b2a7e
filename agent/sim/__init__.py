"""Simulated replicas: a performance model (pure), its profiles (data), and a server that
speaks the engine's OpenAI API with timing from the model. Used by runtime `sim` and by
`fleetctl simulate`; never presented as a real engine (`system_fingerprint: "simulated"`)."""
