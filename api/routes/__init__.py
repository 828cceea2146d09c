"""The routes of both services, bound to their operations: handlers that parse, call the service object, render."""
