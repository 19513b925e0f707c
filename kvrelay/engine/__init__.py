"""The serving core: requests, scheduler, runner, sampler, the step loop."""
