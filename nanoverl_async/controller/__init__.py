"""The controller: the checks before roles start, a warm start, start-up, Ray's placement of the roles (the actors
they run in, the learner pool, their wiring and waits), and `nanoverl-async replay`. The only folder that uses Ray."""
