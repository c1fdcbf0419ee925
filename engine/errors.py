"""What the engine refuses because of the request rather than itself."""


class PromptRejected(ValueError):
    """A prompt the engine cannot serve as sent: empty, too long, a token outside the vocabulary, image tokens that
    do not match the prompt's images. The request's fault: a front end answers it as the client's mistake, while
    any other exception out of the engine is the engine's."""
