"""Parsers of generated text: tool calls (`function_call_parser`) and reasoning
(`reasoning_parser`). Pure Python, no model and no server; `entrypoints.openai_tools` uses them."""
