"""The inference engine: block pool and prefix cache, scheduler, runner, sampling."""
