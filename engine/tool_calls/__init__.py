"""Tool calling, torch-free: how tools and tool turns reach a chat template that does not
know them, which parser reads a model's native tool-call format (chosen by its template),
and how a choice's text becomes OpenAI `tool_calls` (whole or as stream deltas)."""
