"""pyinfra operations (`@operation` functions and the python.call steps of a release), one module
per concern, as pyinfra lays out its own: `caches`, `weights`, `release`, `credentials`, `files`,
`packages`, `tuning`, and `wheelhouse` (the push the agent and runtime roles share). The facts
they read are hgxserve.facts; roles (`@deploy`) call these."""
