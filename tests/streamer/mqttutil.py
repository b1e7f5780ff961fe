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
