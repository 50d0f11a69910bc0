"""Spot-capacity simulator: traces, the discrete-time engine, policies and the ``simulate`` command."""
