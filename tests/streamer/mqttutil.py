"""Helpers for tests that use the shared MQTT broker."""


async def clear_retained(broker_url: str, prefix: str, quiet_s: float = 0.3) -> int:
    """Clear the retained messages under `prefix/` a test left on the shared broker (those the
    broker sends on subscribing; it is done when none came for `quiet_s`)."""
    import asyncio

    import aiomqtt

    from streamer.mqtt import parse_url

    host, port = parse_url(broker_url)
    topics = set()
    async with aiomqtt.Client(host, port) as client:
        await client.subscribe(f"{prefix}/#", qos=1)
        messages = aiter(client.messages)
        while True:
            try:
                message = await asyncio.wait_for(anext(messages), quiet_s)
            except TimeoutError:
                break
            if message.retain and message.payload:
                topics.add(str(message.topic))
        for topic in topics:
            await client.publish(topic, b"", qos=1, retain=True)
    return len(topics)


async def retained(broker_url: str, topic_filter: str) -> dict[str, bytes]:
    """The retained messages under `topic_filter` now, {topic: payload}. The broker sends them on
    subscribing, before it forwards a message this client publishes afterwards: a marker that
    comes back says all of them came (no waiting for a quiet period)."""
    import uuid

    import aiomqtt

    from streamer.mqtt import parse_url

    host, port = parse_url(broker_url)
    marker = f"marker/{uuid.uuid4().hex}"
    found: dict[str, bytes] = {}
    async with aiomqtt.Client(host, port) as client:
        await client.subscribe(topic_filter, qos=1)
        await client.subscribe(marker, qos=1)
        await client.publish(marker, b"end", qos=1)
        async for message in client.messages:
            if str(message.topic) == marker:
                return found
            if message.retain and message.payload:
                found[str(message.topic)] = bytes(message.payload)
    return found
