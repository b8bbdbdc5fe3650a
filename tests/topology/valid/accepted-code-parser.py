# a tool-call parser plugin (test data: never run)
