"""The OpenAI protocol as kvrouter speaks it: request bodies, chat rendering and the built-in tokenizer."""
