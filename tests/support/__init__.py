"""Helpers shared by the test modules: fresh-interpreter programs (:mod:`support.programs`) and the hotfix's mode and
status record set for one test (:mod:`support.environment`)."""
