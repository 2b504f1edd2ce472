"""Why a training job stops early, in words the user can act on."""


class JobStopped(Exception):
    """The job cannot go on for a reason the user can act on; the CLI prints it as one line."""


class NonFiniteTrainingError(JobStopped):
    """A step produced a non-finite loss or gradient; the job stops before applying it."""
