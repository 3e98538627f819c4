"""The fleet simulator: a seeded discrete-event world that drives the real supervisor core.

`controller.sim.engine.simulate(scenario, policy, seed)` runs one policy on one seed and returns
the event log the core wrote (the live controller's format) with its goodput report;
`controller.sim.report` compares policies on shared failure draws; `controller.sim.model` has the
first-order model and the Young/Daly interval it is checked against.
"""
