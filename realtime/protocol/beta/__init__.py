"""The Realtime **beta** protocol, served by translation at the connection's edge.

Older clients speak it (``OpenAI-Beta: realtime=v1``: flat session fields such as ``modalities``
and ``input_audio_format: "pcm16"``, ``response.audio.delta``, ``conversation.item.created``).
A beta connection's client events are renamed into GA events before the GA validation, and the
GA server events renamed into beta events on their way out; sessions and the engine see one
shape. :func:`~.names.beta_requested` says which protocol a connecting client speaks.
"""

from .inbound import client_event_to_ga
from .names import beta_requested
from .outbound import server_event_to_beta

__all__ = ["beta_requested", "client_event_to_ga", "server_event_to_beta"]
