"""Errors a user can cause and fix. The CLI prints them as one line and exits non-zero."""


class KvedgeError(Exception):
    """A problem with the user's input, files or options; the message says what and what is allowed."""


class ArtifactMismatch(KvedgeError):
    """An artifact was made from a different model, geometry or format version than the one in use."""


class ContextOverflow(KvedgeError):
    """A prompt or generation does not fit in the cache. `cause` says which: "prompt" (the
    conversation) or "reply" (the requested reply length)."""

    def __init__(self, message: str, cause: str = "prompt") -> None:
        super().__init__(message)
        self.cause = cause


class ModelFault(KvedgeError):
    """The model or what it loaded produced something unusable (non-finite logits, say): not the
    request's fault. The service ends that request with a 500 and keeps serving the others."""
