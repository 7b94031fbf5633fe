"""Publish one onejob intent from Python (an upstream service in another language)
and wait for its receipt through RabbitMQ's direct reply-to.

    pip install pika
    python3 examples/publish.py acct_42 order-1234 "Text to summarize"

It follows the book's advice to publishers (docs/src/reference/intent.md): every intent carries a
`message_id` (so `onejob dlq replay --id` can pick it out of a dead-letter queue)
and a `timestamp`, and the exit status says what happened, as the CLI's does:
0 for created or duplicate, 1 for conflict or rejected, 2 when no receipt came.
"""
import json
import os
import sys
import time
import uuid

import pika

AMQP_URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")


def submit(owner_id, idempotency_key, text, timeout=30):
    conn = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
    ch = conn.channel()
    ch.confirm_delivery()  # basic_publish now waits for the broker's confirm
    receipt = {}
    correlation_id = str(uuid.uuid4())

    def on_receipt(_ch, _method, props, body):
        if props.correlation_id == correlation_id:
            receipt.update(json.loads(body))

    # Direct reply-to: consume the pseudo-queue, then publish on the same channel.
    ch.basic_consume("amq.rabbitmq.reply-to", on_receipt, auto_ack=True)
    intent = {
        "owner_id": owner_id,
        "idempotency_key": idempotency_key,
        "operation": "summarize",
        "input": {"text": text},
    }
    ch.basic_publish(
        exchange="onejob",
        routing_key="intents",
        body=json.dumps(intent),
        properties=pika.BasicProperties(
            content_type="application/json",
            delivery_mode=2,
            reply_to="amq.rabbitmq.reply-to",
            correlation_id=correlation_id,
            message_id=str(uuid.uuid4()),
            timestamp=int(time.time()),
        ),
        mandatory=True,  # an intent no queue takes raises instead of vanishing
    )
    conn.process_data_events(time_limit=0)
    waited = 0
    while not receipt and waited < timeout:
        conn.process_data_events(time_limit=1)
        waited += 1
    conn.close()
    return receipt or None


if __name__ == "__main__":
    owner, key, text = sys.argv[1], sys.argv[2], sys.argv[3]
    result = submit(owner, key, text)
    if result is None:
        print("no receipt in time; the intent may still be processed: resend it with the same key",
              file=sys.stderr)
        sys.exit(2)
    print(json.dumps(result))
    if result.get("outcome") not in ("created", "duplicate"):
        sys.exit(1)
